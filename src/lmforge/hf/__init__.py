"""lmforge.hf"""
