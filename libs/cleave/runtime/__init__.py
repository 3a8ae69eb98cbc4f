"""What every process needs around its work: its lifecycle (signals, exit), logging, fault injection for
drills, the metrics file, a process's resident memory and the network lab of namespaces and shaped links."""
