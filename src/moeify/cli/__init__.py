"""Command-line interface: the only place that parses argv."""
