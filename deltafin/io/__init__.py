"""Reads: direct I/O into aligned buffers, drives, reader threads, the drive emulator."""
