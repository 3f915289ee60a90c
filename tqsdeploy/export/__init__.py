"""Export: from a score run and a target to a written mixed-precision model."""
