"""Rendering with Blender's command line: frame specs and chunks, argv, log parsing."""
