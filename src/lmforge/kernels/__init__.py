"""lmforge.kernels"""
