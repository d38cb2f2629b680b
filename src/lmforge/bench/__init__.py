"""lmforge.bench"""
