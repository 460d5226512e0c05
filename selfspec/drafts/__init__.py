"""Drafts that need no training, and the drafters that combine others (merge, policy)."""
