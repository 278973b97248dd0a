"""A toy method family added the way docs/skeleton.md describes (``test_new_method.py``)."""
