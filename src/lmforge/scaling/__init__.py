"""lmforge.scaling"""
