"""Adapters of the field's environment libraries, each written as an installable plugin would be."""
