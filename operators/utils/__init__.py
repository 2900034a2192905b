"""Small helpers with no home of their own in a role folder."""
