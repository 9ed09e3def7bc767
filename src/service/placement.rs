//! Where the target's copies run and which drafters each one feeds (`target.capture_devices`). A drafter is fed by
//! a copy on its own device when there is one (so features never cross devices), else by the copies elsewhere; the
//! drafters that share a set of candidates are spread over it in turn.
use std::collections::HashMap;

use anyhow::{Context, Result};
use tch::{Device, Kind};

use crate::config::{CapturePlacement, Config};

/// The devices (and compute dtypes) of the target copies that capture features.
pub fn capture_devices(
    config: &Config,
    target: (Device, Kind),
    drafters: &[(Device, Kind)],
) -> Result<Vec<(Device, Kind)>> {
    Ok(match &config.target.capture {
        CapturePlacement::TargetDevice => vec![target],
        CapturePlacement::Colocated => {
            let mut devices: Vec<Device> = Vec::new();
            for (d, _) in drafters {
                if !devices.contains(d) {
                    devices.push(*d);
                }
            }
            devices.into_iter().map(|d| (d, config.target.dtype.resolve(d))).collect()
        }
        CapturePlacement::Devices(list) => list
            .iter()
            .map(|spec| {
                let d = spec.resolve().context("target.capture_devices")?;
                Ok((d, config.target.dtype.resolve(d)))
            })
            .collect::<Result<_>>()?,
    })
}

/// The devices `target.spread_to` names, resolved: allowed for one target copy only (each copy would need devices
/// of its own).
pub fn spread_to(config: &Config, copies: usize) -> Result<Vec<Device>> {
    let list = &config.target.spread_to;
    if !list.is_empty() && copies != 1 {
        anyhow::bail!(
            "target.spread_to spreads one target copy over more devices, but target.capture_devices makes {copies} \
             copies: use one copy (capture_devices = []) or leave spread_to empty"
        );
    }
    list.iter().map(|d| d.resolve().context("target.spread_to")).collect()
}

/// For each drafter (by its device), the index of the target copy that feeds it.
pub fn assign_targets(drafters: &[Device], targets: &[Device]) -> Vec<usize> {
    let mut next: HashMap<Vec<usize>, usize> = HashMap::new();
    drafters
        .iter()
        .map(|d| {
            let local: Vec<usize> = (0..targets.len()).filter(|&t| targets[t] == *d).collect();
            let candidates = if local.is_empty() { (0..targets.len()).collect() } else { local };
            let turn = next.entry(candidates.clone()).or_insert(0);
            let chosen = candidates[*turn % candidates.len()];
            *turn += 1;
            chosen
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafters_are_fed_on_their_own_device_and_spread_over_the_others() {
        let (c0, c1, c2) = (Device::Cuda(0), Device::Cuda(1), Device::Cuda(2));
        // Colocated: each drafter by the copy on its GPU.
        assert_eq!(assign_targets(&[c0, c1, c2], &[c0, c1, c2]), vec![0, 1, 2]);
        // Dedicated target GPUs: drafters elsewhere take them in turn.
        assert_eq!(assign_targets(&[c1, c2, c1, c2], &[c0, Device::Cuda(3)]), vec![0, 1, 0, 1]);
        // Two copies on one device, with the drafters there: spread over both.
        assert_eq!(
            assign_targets(&[Device::Cpu, Device::Cpu, Device::Cpu], &[Device::Cpu, Device::Cpu]),
            vec![0, 1, 0]
        );
        // A single copy feeds everyone.
        assert_eq!(assign_targets(&[c0, c1], &[c0]), vec![0, 0]);
        // Mixed: the drafter on cuda:0 keeps its local copy; the others share the rest in turn.
        assert_eq!(assign_targets(&[c0, c2, c2], &[c0, c1]), vec![0, 0, 1]);
    }
}
