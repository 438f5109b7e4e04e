"""Paged attention: shared types, the reference path and the backend selector (the C kernel's wrapper is
engine/cpu/attention.py)."""
