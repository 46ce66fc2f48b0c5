"""Domino: tensor-parallel communication hidden behind compute (batch split, column split, 2-D)."""
