"""Training the speculative drafters (MTP assistants, draft models): offline, not on the serving path."""
