"""lmforge.eval"""
