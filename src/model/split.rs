//! Where each decoder layer of a target that spans several devices lives. Layers are split into contiguous runs,
//! one run per device in order, each device's share of the bytes in proportion to its capacity (the free memory of
//! GPUs); the first device also holds the embedding, the final norm and the LM head (`first_device_bytes`), so it
//! takes fewer layers. Capture then runs the runs in order, moving only the hidden state `[B, S, hidden]` from one
//! device to the next.

/// The device index of each layer: contiguous runs, every device at least one layer when there are enough, each
/// device filled left to right up to its share of the bytes, `capacity[d] / sum(capacity)` (equal capacities give
/// equal shares).
pub fn split_layers(layer_bytes: &[u64], first_device_bytes: u64, capacity: &[u64]) -> Vec<usize> {
    let (layers, devices) = (layer_bytes.len(), capacity.len());
    if devices <= 1 || layers == 0 {
        return vec![0; layers];
    }
    let total = (layer_bytes.iter().sum::<u64>() + first_device_bytes) as u128;
    let weights: Vec<u128> = capacity.iter().map(|&c| c.max(1) as u128).collect();
    let weight_sum: u128 = weights.iter().sum();
    let share = |d: usize| (total * weights[d]).div_ceil(weight_sum) as u64;
    let mut owner = Vec::with_capacity(layers);
    let (mut device, mut load, mut held) = (0usize, first_device_bytes, 0usize);
    for (l, &bytes) in layer_bytes.iter().enumerate() {
        let layers_left = layers - l;
        let devices_after = devices - 1 - device;
        // Move on when this layer would overfill the share (and this device has one), or when every later device
        // needs a layer of what is left.
        let overfull = held > 0 && load + bytes > share(device);
        if device + 1 < devices && (overfull || layers_left <= devices_after) && held > 0 {
            device += 1;
            load = 0;
            held = 0;
        }
        owner.push(device);
        load += bytes;
        held += 1;
    }
    owner
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(owner: &[usize]) -> Vec<usize> {
        let mut counts = vec![0; owner.iter().max().map_or(0, |m| m + 1)];
        owner.iter().for_each(|&d| counts[d] += 1);
        counts
    }

    #[test]
    fn equal_layers_split_evenly_and_in_order() {
        let owner = split_layers(&[10; 8], 0, &[1, 1]);
        assert_eq!(owner, vec![0, 0, 0, 0, 1, 1, 1, 1]);
        assert_eq!(runs(&split_layers(&[10; 9], 0, &[5, 5, 5])), vec![3, 3, 3]);
        assert!(split_layers(&[10; 7], 0, &[1; 3]).windows(2).all(|w| w[0] <= w[1] && w[1] - w[0] <= 1), "contiguous");
    }

    #[test]
    fn the_first_device_takes_fewer_layers_for_the_embedding_and_head() {
        // 8 layers of 10 plus 20 on device 0: shares of 50, so device 0 takes 3 layers (50), device 1 five.
        assert_eq!(runs(&split_layers(&[10; 8], 20, &[1, 1])), vec![3, 5]);
    }

    #[test]
    fn a_device_with_more_free_memory_takes_more_layers() {
        // 12 layers of 10 over capacities 1:2: shares of 40 and 80.
        assert_eq!(runs(&split_layers(&[10; 12], 0, &[100, 200])), vec![4, 8]);
        assert_eq!(runs(&split_layers(&[10; 12], 0, &[300, 100])), vec![9, 3]);
        // A device reporting nothing free still gets a layer (and the load check refuses it, not the split).
        assert_eq!(runs(&split_layers(&[10; 4], 0, &[0, 100])), vec![1, 3]);
    }

    #[test]
    fn every_device_gets_a_layer_and_one_device_or_none_is_trivial() {
        assert_eq!(runs(&split_layers(&[1, 1, 100], 0, &[1; 3])), vec![1, 1, 1]);
        assert_eq!(runs(&split_layers(&[100, 1, 1, 1], 0, &[1, 1])), vec![1, 3]);
        assert_eq!(split_layers(&[5, 5], 0, &[1]), vec![0, 0]);
        assert_eq!(split_layers(&[5, 5], 0, &[1; 4]), vec![0, 1], "more devices than layers: one layer each");
        assert!(split_layers(&[], 0, &[1, 1]).is_empty());
    }
}
