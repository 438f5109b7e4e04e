"""Paged attention: shared types, the reference path, the C kernel's wrapper and the backend selector."""
