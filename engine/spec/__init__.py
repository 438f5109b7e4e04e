"""Speculative decoding: config, proposers (ngram, suffix, draft_model, mtp) and verification."""
