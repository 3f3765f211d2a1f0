"""Development tools run from the repository root (a regular package, so that `lint-imports` imports
`tools.lint_contracts` from here even where an installed distribution ships a top-level `tools`)."""
