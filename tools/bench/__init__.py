"""Benchmarks beside the server (they use its HTTP API and serving.bundle only):
server (subprocesses under test) · head (the head alone in numpy) · run (`slc bench scale`) ·
report (targets, tables, plot) · index (`slc bench index`) · torch_peer (the plain baseline);
cli holds the commands."""
