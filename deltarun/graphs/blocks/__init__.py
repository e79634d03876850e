"""Blocks any hybrid family composes: attention, delta net, FFN, heads (see deltarun/graphs/family.py)."""
