"""Reports: the JSON envelope every command writes, and the self-contained HTML pages."""
