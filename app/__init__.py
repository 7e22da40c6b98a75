"""hsx: hidden-state extraction service."""
