//! Which host this process is in a run of several, from the `[cluster]` keys or, where they are left unset, the
//! environment the cluster's launcher sets for PyTorch jobs: torchrun (`MASTER_ADDR`, `MASTER_PORT`, `RANK`,
//! `GROUP_RANK`, `WORLD_SIZE`, `GROUP_WORLD_SIZE`, `LOCAL_WORLD_SIZE`), Kubeflow's PyTorchJob (`MASTER_ADDR`,
//! `MASTER_PORT`, `RANK`, `WORLD_SIZE`), or a Slurm script exporting `NODE_RANK` and `NNODES`
//! (docs/several-gpus-and-hosts.md). dflash runs one process per host, driving every GPU of it, so the host's rank
//! is the node rank: with one process per node torchrun's `RANK` equals its `GROUP_RANK` and `WORLD_SIZE` the
//! number of nodes.
use std::str::FromStr;
use std::time::Duration;

use thiserror::Error;

/// The `[cluster]` keys that were set; the rest come from the environment ([`resolve`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterSettings {
    pub hosts: Option<usize>,
    pub rank: Option<usize>,
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
    /// How long a host waits for the rendezvous host's store (and the others) at start.
    pub rendezvous_timeout: Duration,
    /// How long a round waits for a host's contribution before it closes without that host.
    pub round_timeout: Duration,
    /// How long rank 0 may stay silent before another host takes it for lost.
    pub leader_timeout: Duration,
}

/// Nothing set: everything from the environment, the rendezvous waited for as long as `config/default.toml` says.
impl Default for ClusterSettings {
    fn default() -> Self {
        ClusterSettings {
            hosts: None,
            rank: None,
            master_addr: None,
            master_port: None,
            rendezvous_timeout: Duration::from_secs(300),
            round_timeout: Duration::from_secs(120),
            leader_timeout: Duration::from_secs(60),
        }
    }
}

/// torchrun's default rendezvous port.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// This process's place in a run of several hosts.
#[derive(Debug, Clone, PartialEq)]
pub struct HostPlacement {
    pub hosts: usize,
    pub rank: usize,
    /// The rendezvous host, where the store is served.
    pub master_addr: String,
    pub master_port: u16,
    /// Whether this process serves the store: rank 0 does, unless the launcher's agent serves one already
    /// (torchrun sets `TORCHELASTIC_USE_AGENT_STORE=True`).
    pub serves_store: bool,
    pub rendezvous_timeout: Duration,
    /// How long rank 0 may stay silent before this host takes it for lost (`cluster.leader_timeout_s`).
    pub leader_timeout: Duration,
}

#[derive(Debug, Error, PartialEq)]
pub enum LaunchError {
    #[error("{source_name}={value:?}: {wants}")]
    BadValue { source_name: String, value: String, wants: &'static str },
    #[error(
        "LOCAL_WORLD_SIZE={0}: dflash runs one process per host, driving all of its GPUs (drafters.devices); launch \
         one per node (torchrun --nproc-per-node=1, one Slurm task per node, one PyTorchJob replica per node)"
    )]
    SeveralProcessesPerHost(usize),
    #[error(
        "{node_source}={node_rank} but RANK={rank}: with one process per host they are the same; dflash runs one \
         process per host (torchrun --nproc-per-node=1)"
    )]
    RankMismatch { node_source: String, node_rank: usize, rank: usize },
    #[error("host rank {rank} (from {source_name}) is not below the number of hosts, {hosts}")]
    RankOutOfRange { rank: usize, hosts: usize, source_name: String },
    #[error(
        "a run of {hosts} hosts needs this host's rank: set NODE_RANK or RANK (the launcher does), or cluster.rank"
    )]
    NoRank { hosts: usize },
    #[error(
        "a run of {hosts} hosts needs the rendezvous host's address: set MASTER_ADDR (torchrun, PyTorchJob and the \
         Slurm script in docs/several-gpus-and-hosts.md do) or cluster.master_addr"
    )]
    NoMaster { hosts: usize },
}

/// Where this process stands: `None` for a run on one host (nothing set anywhere, or one host), else its
/// [`HostPlacement`]. `env` reads an environment variable (`|k| std::env::var(k).ok()` in the binary). A key set in
/// `[cluster]` wins over the environment.
pub fn resolve(
    settings: &ClusterSettings,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<HostPlacement>, LaunchError> {
    if let Some((local, _)) = number::<usize>(&env, "LOCAL_WORLD_SIZE", "a count of processes")?
        && local > 1
    {
        return Err(LaunchError::SeveralProcessesPerHost(local));
    }
    let hosts = match settings.hosts {
        Some(h) => Some((h, "cluster.hosts".to_string())),
        None => first_number(&env, &["NNODES", "GROUP_WORLD_SIZE", "WORLD_SIZE"], "a number of hosts >= 1")?,
    };
    let Some((hosts, hosts_source)) = hosts else {
        return Ok(None);
    };
    if hosts == 0 {
        return Err(LaunchError::BadValue {
            source_name: hosts_source,
            value: "0".into(),
            wants: "a number of hosts >= 1",
        });
    }
    if hosts == 1 {
        return Ok(None);
    }
    let rank = match settings.rank {
        Some(r) => (r, "cluster.rank".to_string()),
        None => {
            let node = first_number::<usize>(&env, &["NODE_RANK", "GROUP_RANK"], "this host's rank (0-based)")?;
            let global = number::<usize>(&env, "RANK", "this host's rank (0-based)")?;
            match (node, global) {
                (Some((n, source)), Some((r, _))) if n != r => {
                    return Err(LaunchError::RankMismatch { node_source: source, node_rank: n, rank: r });
                }
                (Some(found), _) | (None, Some(found)) => found,
                (None, None) => return Err(LaunchError::NoRank { hosts }),
            }
        }
    };
    if rank.0 >= hosts {
        return Err(LaunchError::RankOutOfRange { rank: rank.0, hosts, source_name: rank.1 });
    }
    let master_addr = match &settings.master_addr {
        Some(a) => a.clone(),
        None => env("MASTER_ADDR").filter(|a| !a.is_empty()).ok_or(LaunchError::NoMaster { hosts })?,
    };
    let master_port = match settings.master_port {
        Some(p) => p,
        None => number::<u16>(&env, "MASTER_PORT", "a TCP port")?.map_or(DEFAULT_MASTER_PORT, |(p, _)| p),
    };
    let agent_store = env("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true"));
    Ok(Some(HostPlacement {
        hosts,
        rank: rank.0,
        master_addr,
        master_port,
        serves_store: rank.0 == 0 && !agent_store,
        rendezvous_timeout: settings.rendezvous_timeout,
        leader_timeout: settings.leader_timeout,
    }))
}

/// The environment variable `name` parsed, with its name; `None` when unset or empty.
fn number<T: FromStr>(
    env: &impl Fn(&str) -> Option<String>,
    name: &str,
    wants: &'static str,
) -> Result<Option<(T, String)>, LaunchError> {
    match env(name).map(|v| v.trim().to_string()).filter(|v| !v.is_empty()) {
        None => Ok(None),
        Some(v) => v.parse().map(|n| Some((n, name.to_string()))).map_err(|_| LaunchError::BadValue {
            source_name: name.to_string(),
            value: v,
            wants,
        }),
    }
}

/// The first of `names` that is set, parsed.
fn first_number<T: FromStr>(
    env: &impl Fn(&str) -> Option<String>,
    names: &[&str],
    wants: &'static str,
) -> Result<Option<(T, String)>, LaunchError> {
    for name in names {
        if let Some(found) = number(env, name, wants)? {
            return Ok(Some(found));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn unset() -> ClusterSettings {
        ClusterSettings::default()
    }

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn nothing_set_or_one_host_is_a_single_host_run() {
        assert_eq!(resolve(&unset(), env(&[])), Ok(None));
        assert_eq!(resolve(&unset(), env(&[("WORLD_SIZE", "1"), ("RANK", "0")])), Ok(None));
    }

    #[test]
    fn torchrun_with_one_process_per_node() {
        // torchrun --nnodes=3 --nproc-per-node=1 on the second node, its agent serving the store.
        let vars = [
            ("MASTER_ADDR", "node-a"),
            ("MASTER_PORT", "29400"),
            ("RANK", "1"),
            ("GROUP_RANK", "1"),
            ("WORLD_SIZE", "3"),
            ("GROUP_WORLD_SIZE", "3"),
            ("LOCAL_WORLD_SIZE", "1"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ];
        let p = resolve(&unset(), env(&vars)).unwrap().unwrap();
        assert_eq!((p.hosts, p.rank, p.master_addr.as_str(), p.master_port), (3, 1, "node-a", 29400));
        assert!(!p.serves_store);
        // Rank 0 with the agent's store connects to it rather than serving another on the same port.
        let rank0 = [("RANK", "0"), ("GROUP_RANK", "0"), ("WORLD_SIZE", "3"), ("MASTER_ADDR", "node-a")];
        let mut with_agent = rank0.to_vec();
        with_agent.push(("TORCHELASTIC_USE_AGENT_STORE", "True"));
        assert!(!resolve(&unset(), env(&with_agent)).unwrap().unwrap().serves_store);
        assert!(resolve(&unset(), env(&rank0)).unwrap().unwrap().serves_store);
    }

    #[test]
    fn pytorchjob_and_slurm_environments() {
        // Kubeflow PyTorchJob, one replica per node: RANK and WORLD_SIZE; the default port.
        let p = resolve(&unset(), env(&[("MASTER_ADDR", "job-master-0"), ("RANK", "2"), ("WORLD_SIZE", "4")]))
            .unwrap()
            .unwrap();
        assert_eq!((p.hosts, p.rank, p.master_port), (4, 2, DEFAULT_MASTER_PORT));
        // The Slurm script of docs/several-gpus-and-hosts.md: NODE_RANK and NNODES from SLURM_NODEID and
        // SLURM_NNODES.
        let vars = [("MASTER_ADDR", "gpu017"), ("MASTER_PORT", "29500"), ("NODE_RANK", "0"), ("NNODES", "2")];
        let p = resolve(&unset(), env(&vars)).unwrap().unwrap();
        assert_eq!((p.hosts, p.rank, p.serves_store), (2, 0, true));
    }

    #[test]
    fn cluster_keys_win_over_the_environment() {
        let settings = ClusterSettings {
            hosts: Some(2),
            rank: Some(1),
            master_addr: Some("10.0.0.1".into()),
            master_port: Some(30000),
            ..unset()
        };
        let p = resolve(&settings, env(&[("MASTER_ADDR", "elsewhere"), ("RANK", "5"), ("WORLD_SIZE", "8")]))
            .unwrap()
            .unwrap();
        assert_eq!((p.hosts, p.rank, p.master_addr.as_str(), p.master_port), (2, 1, "10.0.0.1", 30000));
    }

    #[test]
    fn bad_launches_are_refused_naming_the_variable_and_what_to_do() {
        let cases: [(&[(&str, &str)], &str); 6] = [
            (&[("WORLD_SIZE", "two")], "WORLD_SIZE=\"two\": a number of hosts"),
            (&[("WORLD_SIZE", "8"), ("LOCAL_WORLD_SIZE", "8"), ("RANK", "3")], "--nproc-per-node=1"),
            (&[("WORLD_SIZE", "2"), ("MASTER_ADDR", "a")], "NODE_RANK or RANK"),
            (&[("WORLD_SIZE", "2"), ("RANK", "2"), ("MASTER_ADDR", "a")], "rank 2 (from RANK) is not below"),
            (&[("NNODES", "2"), ("NODE_RANK", "1")], "MASTER_ADDR"),
            (&[("NNODES", "2"), ("NODE_RANK", "1"), ("RANK", "3"), ("MASTER_ADDR", "a")], "NODE_RANK=1 but RANK=3"),
        ];
        for (vars, wanted) in cases {
            let err = resolve(&unset(), env(vars)).unwrap_err().to_string();
            assert!(err.contains(wanted), "{vars:?}: {err}");
        }
        let err = resolve(
            &unset(),
            env(&[("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_ADDR", "a"), ("MASTER_PORT", "70000")]),
        )
        .unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT=\"70000\": a TCP port"), "{err}");
    }
}
