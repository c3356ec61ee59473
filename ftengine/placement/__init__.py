"""Expert placement: EPLB maps, dead-rank redistribution, MC2 elastic_info."""
