"""Caches that imitate other systems' eviction, kept as baselines to compare Penelope with."""
