"""Reference implementations of the number formats: readable torch code, exact by definition."""
