"""Building blocks of the torch engine's model: rotary embedding and slot-cache attention."""
