"""Exporters: a schedule (or a measured run) as a picture, a trace, or another tool's format."""
