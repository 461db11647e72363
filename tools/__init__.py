"""Experiments, benchmarks and the load tester: above trainer/ and serving/, never imported by them."""
