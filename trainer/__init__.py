"""Training, metrics, calibration and export. Importing the package imports no torch."""
