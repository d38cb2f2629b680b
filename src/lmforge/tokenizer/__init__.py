"""lmforge.tokenizer"""
