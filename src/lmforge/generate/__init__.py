"""lmforge.generate"""
