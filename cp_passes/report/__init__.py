"""Reports on compiled graphs: the rewrite table, graph counts, dumps to a folder or torch's trace."""
