"""Bridges to other libraries (e.g. the Hugging Face attention interface). None yet:
see issue 3."""
__all__: list = []
