"""Model definitions and checkpoint loading for the torch engine."""
