//! Several hosts in one run. One `serve-train` process per host; what crosses hosts goes through PyTorch's own
//! distributed engine rather than a protocol of ours: c10d's TCPStore (the rendezvous torchrun and Kubeflow's
//! PyTorchJob use) for who is in the run, each step's quorum and failure notices, and NCCL for tensors. Launch reads
//! the torchrun environment (`MASTER_ADDR`, `MASTER_PORT`, `RANK`/`NODE_RANK`, `WORLD_SIZE`/`NNODES`).
pub mod background;
pub mod exchange;
pub mod launch;
pub mod quorum;
pub mod store;
