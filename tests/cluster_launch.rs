//! The launch recipes docs/several-gpus-and-hosts.md gives work as written: the Slurm script, run with Slurm's
//! environment and stand-ins for `scontrol`, `srun` and `dflash`, gives each host the environment dflash resolves
//! to its place in the run; the Kubeflow PyTorchJob manifest parses and carries what the training operator and
//! dflash need.
mod doc_blocks;

use std::collections::HashMap;
use std::path::Path;

use dflash::cluster::launch::{ClusterSettings, resolve};
use doc_blocks::doc_block;
use serde_json::Value;

fn write_executable(path: &Path, body: &str) {
    std::fs::write(path, body).unwrap();
    let mut perms = std::fs::metadata(path).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(path, perms).unwrap();
}

#[test]
fn the_slurm_script_gives_each_node_its_place_in_the_run() {
    let script = doc_block("docs/several-gpus-and-hosts.md", "bash", "#SBATCH");
    assert!(script.contains("#SBATCH --ntasks-per-node=1"), "one task (process) per node:\n{script}");
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    // Stand-ins: scontrol expands the node list (and says when the job is requeued), srun runs the task here,
    // dflash reports what it was given and exits with $STANDIN_STATUS.
    write_executable(
        &bin.join("scontrol"),
        "#!/bin/sh\nif [ \"$1\" = requeue ]; then echo REQUEUED=$2; exit 0; fi\nprintf 'gpu017\\ngpu018\\n'\n",
    );
    write_executable(&bin.join("srun"), "#!/bin/sh\nwhile [ \"${1#--}\" != \"$1\" ]; do shift; done\nexec \"$@\"\n");
    write_executable(
        &bin.join("dflash"),
        "#!/bin/sh\nfor v in MASTER_ADDR MASTER_PORT NODE_RANK NNODES RANK WORLD_SIZE; do eval \"echo $v=\\${$v}\"; done\n\
         echo ARGS=\"$*\"\nexit ${STANDIN_STATUS:-0}\n",
    );
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    // The script as Slurm runs it on `node`, with the stand-in dflash ending with `status`.
    let run = |node: usize, status: i32| {
        std::process::Command::new("bash")
            .arg("-c")
            .arg(&script)
            .env_clear()
            .env("PATH", &path)
            .env("SLURM_JOB_NODELIST", "gpu[017-018]")
            .env("SLURM_NNODES", "2")
            .env("SLURM_NODEID", node.to_string())
            .env("SLURM_JOB_ID", "4242")
            .env("STANDIN_STATUS", status.to_string())
            .output()
            .unwrap()
    };
    for node in 0..2 {
        let out = run(node, 0);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
        let env: HashMap<String, String> = stdout
            .lines()
            .filter_map(|l| l.split_once('='))
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert!(env["ARGS"].contains("serve-train") && env["ARGS"].contains("--resume auto"), "{env:?}");
        let placed =
            resolve(&ClusterSettings::default(), |k| env.get(k).cloned()).unwrap().expect("a run of two hosts");
        assert_eq!((placed.hosts, placed.rank, placed.master_addr.as_str()), (2, node, "gpu017"));
        assert_eq!(placed.serves_store, node == 0, "the first node serves the store");
        assert!(!env.contains_key("REQUEUED"), "a complete run is not requeued");
    }
    // A run stopped before completion (SIGTERM: 143), or asking for a restart (75), is requeued; an error is not.
    for (status, requeued) in [(143, true), (130, true), (75, true), (1, false), (3, false)] {
        let out = run(0, status);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(status), "the script ends with dflash's status: {stdout}");
        assert_eq!(stdout.contains("REQUEUED=4242"), requeued, "status {status}: {stdout}");
    }
}

#[test]
fn the_pytorchjob_manifest_carries_what_the_operator_and_dflash_need() {
    let manifest = doc_block("docs/several-gpus-and-hosts.md", "yaml", "PyTorchJob");
    // PyYAML (Debian's python3-yaml) turns it into JSON.
    let python = ["/usr/bin/python3", "python3"]
        .into_iter()
        .find(|p| std::process::Command::new(p).args(["-c", "import yaml"]).output().is_ok_and(|o| o.status.success()));
    let python = python.expect("python3 with PyYAML (Debian package python3-yaml)");
    let mut child = std::process::Command::new(python)
        .args(["-c", "import json, sys, yaml; print(json.dumps(yaml.safe_load(sys.stdin)))"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), manifest.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the manifest is YAML");
    let job: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((job["apiVersion"].as_str(), job["kind"].as_str()), (Some("kubeflow.org/v1"), Some("PyTorchJob")));
    let specs = &job["spec"]["pytorchReplicaSpecs"];
    assert_eq!(specs["Master"]["replicas"], 1, "one rendezvous host");
    assert!(specs["Worker"]["replicas"].as_u64().unwrap() >= 1);
    for role in ["Master", "Worker"] {
        let spec = &specs[role];
        assert_eq!(spec["restartPolicy"], "OnFailure", "{role}: a failed host restarts and rejoins");
        let grace = spec["template"]["spec"]["terminationGracePeriodSeconds"].as_u64().unwrap_or(30);
        assert!(grace >= 300, "{role}: time to finish a checkpoint when the job is stopped (rank 0's, or this host's)");
        let containers = spec["template"]["spec"]["containers"].as_array().unwrap();
        assert_eq!(containers.len(), 1, "{role}: one process per pod");
        let c = &containers[0];
        assert_eq!(c["name"], "pytorch", "{role}: the operator sets the environment in the container named pytorch");
        let command: Vec<&str> = c["command"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
        assert!(command.starts_with(&["dflash", "serve-train"]), "{role}: {command:?}");
        assert!(command.windows(2).any(|w| w == ["--resume", "auto"]), "{role}: {command:?}");
        let port = c["ports"].as_array().unwrap().iter().find(|p| p["name"] == "pytorchjob-port");
        assert!(port.is_some_and(|p| p["containerPort"].as_u64().is_some()), "{role}: the rendezvous port");
        assert!(c["resources"]["limits"]["nvidia.com/gpu"].as_u64().unwrap() >= 1, "{role}: GPUs");
        let mounts: Vec<&str> =
            c["volumeMounts"].as_array().unwrap().iter().map(|m| m["mountPath"].as_str().unwrap()).collect();
        assert!(mounts.contains(&"/checkpoints"), "{role}: checkpoints on a volume that outlives the pod");
    }
}
