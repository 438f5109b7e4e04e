"""Training the speculative drafters (MTP assistants, small draft models): offline, not on the serving path."""
