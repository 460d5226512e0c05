"""The runtime core: trees, the target's forward, acceptance, sampling, the drafter protocol and the loop."""
