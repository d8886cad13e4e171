"""Experiment grids: many real testbed runs from one YAML file, with a results table and a report."""
