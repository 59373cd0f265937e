"""Bytes from disk: alignment math, aligned host buffers, positioned reads, mappings."""
