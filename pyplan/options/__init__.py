"""What every command checks of its input before it starts: numbers (each option's range,
declared with it), environment (the variables pyplan reads, one table) and outputs (no output
lands on what a command reads or must keep)."""
