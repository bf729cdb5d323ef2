"""The on-disk format: manifest, trunk, one file per expert over drives; the packer that writes it."""
