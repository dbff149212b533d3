"""The update diagnostic: compare one update computed at several depths."""
