"""Tools that are not experiments: the dashboard screenshots, the search's load measurement (with its
timing probe) and the throwaway PostgreSQL / MLflow services it and the distributed tests start; each
command runs as ``python -m benchmarks.tools.<name>``."""
