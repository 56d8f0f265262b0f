"""The JSON-schema front end: references, exact rewrites, logic, the keywords each backend
enforces, number bounds, enum filtering and the productivity (empty-language) check."""
