"""What the user wrote, checked: YAML with line numbers, frozen models, every error at once."""
