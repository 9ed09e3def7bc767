//! Keys and values kept between decoding steps, for the target (every token it has seen) and the drafter (the
//! projected context of every accepted token). Preallocated to a capacity, so a step writes its new rows in place
//! and reads a prefix view: no reallocation or concatenation per token. Cropping is a length change: the rows past
//! it are overwritten by the next step.
use tch::{Device, Kind, Tensor};

use super::ModelError;

/// Per-layer keys and values `[batch, kv_heads, capacity, head_dim]`, the first `len` positions valid.
pub struct KvCache {
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    len: i64,
    capacity: i64,
}

impl KvCache {
    pub fn new(
        layers: usize,
        batch: i64,
        kv_heads: i64,
        head_dim: i64,
        capacity: i64,
        kind: Kind,
        device: Device,
    ) -> Result<Self, ModelError> {
        Self::on_devices(&vec![device; layers], batch, kv_heads, head_dim, capacity, kind)
    }

    /// A cache whose layer `i` lives on `devices[i]` (a target spread over several devices).
    pub fn on_devices(
        devices: &[Device],
        batch: i64,
        kv_heads: i64,
        head_dim: i64,
        capacity: i64,
        kind: Kind,
    ) -> Result<Self, ModelError> {
        let shape = [batch, kv_heads, capacity, head_dim];
        let make = || -> Result<Vec<Tensor>, ModelError> {
            devices.iter().map(|&device| Ok(Tensor::f_zeros(shape, (kind, device))?)).collect()
        };
        Ok(KvCache { keys: make()?, values: make()?, len: 0, capacity })
    }

    /// Positions held.
    pub fn len(&self) -> i64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn capacity(&self) -> i64 {
        self.capacity
    }

    /// Checks that `count` more positions fit.
    pub fn reserve(&self, count: i64) -> Result<(), ModelError> {
        if self.len + count > self.capacity {
            return Err(ModelError::Batch(format!(
                "the KV cache holds {} positions: {} more do not fit (raise the decoding length limit)",
                self.capacity,
                count - (self.capacity - self.len)
            )));
        }
        Ok(())
    }

    /// Writes `keys`/`values` `[batch, kv_heads, T, head_dim]` of `layer` at positions `len..len + T` and returns
    /// views of positions `0..len + T`. The length itself moves on with [`KvCache::advance`], once every layer has
    /// written.
    pub fn write(&mut self, layer: usize, keys: &Tensor, values: &Tensor) -> Result<(Tensor, Tensor), ModelError> {
        let t = keys.size()[2];
        self.reserve(t)?;
        self.keys[layer].f_narrow(2, self.len, t)?.f_copy_(keys)?;
        self.values[layer].f_narrow(2, self.len, t)?.f_copy_(values)?;
        Ok((self.keys[layer].f_narrow(2, 0, self.len + t)?, self.values[layer].f_narrow(2, 0, self.len + t)?))
    }

    /// Writes `keys`/`values` `[batch, kv_heads, T, head_dim]` of `layer` at `positions` (`[T]`, int64, on the
    /// layer's device) and returns `layer`'s whole buffers: where the positions come from a device tensor, so that
    /// nothing about the step depends on the host (a CUDA graph's step). The length moves on with
    /// [`KvCache::advance`] as usual.
    pub fn write_at(
        &mut self,
        layer: usize,
        positions: &Tensor,
        keys: &Tensor,
        values: &Tensor,
    ) -> Result<(Tensor, Tensor), ModelError> {
        let _ = self.keys[layer].f_index_copy_(2, positions, keys)?;
        let _ = self.values[layer].f_index_copy_(2, positions, values)?;
        Ok((self.keys[layer].shallow_clone(), self.values[layer].shallow_clone()))
    }

    /// Writes a prefill's `keys`/`values` `[N, kv_heads, P, head_dim]` of `layer` at positions `0..P` of the batch
    /// rows `rows` (`[N]`, int64, on the layer's device): the first positions of new sequences in a cache whose rows
    /// hold sequences of their own lengths (batched generation, which keeps those lengths itself).
    pub fn fill_rows(&mut self, layer: usize, rows: &Tensor, keys: &Tensor, values: &Tensor) -> Result<(), ModelError> {
        let p = keys.size()[2];
        if p > self.capacity {
            return Err(ModelError::Batch(format!(
                "a prompt of {p} positions exceeds the KV cache's {}",
                self.capacity
            )));
        }
        let _ = self.keys[layer].f_narrow(2, 0, p)?.f_index_copy_(0, rows, keys)?;
        let _ = self.values[layer].f_narrow(2, 0, p)?.f_index_copy_(0, rows, values)?;
        Ok(())
    }

    /// Writes one new position for each of the first `B` rows, `keys`/`values` `[B, kv_heads, 1, head_dim]` of `layer`
    /// at row `b`'s position `positions[b]` (`[B]`, int64, on the layer's device), and returns views of positions
    /// `0..len` of those rows (the caller masks what each row does not hold). Nothing depends on the host: a CUDA
    /// graph may capture it.
    pub fn write_rows(
        &mut self,
        layer: usize,
        positions: &Tensor,
        keys: &Tensor,
        values: &Tensor,
        len: i64,
    ) -> Result<(Tensor, Tensor), ModelError> {
        let size = keys.size();
        let slots = positions.f_view([size[0], 1, 1, 1])?.f_expand(&size, false)?;
        let _ = self.keys[layer].f_scatter_(2, &slots, keys)?;
        let _ = self.values[layer].f_scatter_(2, &slots, values)?;
        let (k, v) = self.prefix(layer, len)?;
        Ok((k.f_narrow(0, 0, size[0])?, v.f_narrow(0, 0, size[0])?))
    }

    /// Copies what `other` (a cache of the same rows and layers, no larger) holds into this one's first positions.
    pub fn copy_from(&self, other: &KvCache) -> Result<(), ModelError> {
        for (mine, theirs) in self.keys.iter().chain(&self.values).zip(other.keys.iter().chain(&other.values)) {
            mine.f_narrow(2, 0, other.capacity)?.f_copy_(theirs)?;
        }
        Ok(())
    }

    /// Views of the first `len` rows of `layer`'s buffers, held or not (`len` up to the capacity): for callers that
    /// mask the rows past [`KvCache::len`] themselves, to keep attention shapes from changing every step.
    pub fn prefix(&self, layer: usize, len: i64) -> Result<(Tensor, Tensor), ModelError> {
        Ok((self.keys[layer].f_narrow(2, 0, len)?, self.values[layer].f_narrow(2, 0, len)?))
    }

    /// Counts `count` positions written by every layer as held.
    pub fn advance(&mut self, count: i64) {
        self.len += count;
    }

    /// Keeps the first `len` positions (no-op past the current length).
    pub fn crop(&mut self, len: i64) {
        self.len = self.len.min(len.max(0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_in_place_and_crops() {
        let mut c = KvCache::new(2, 1, 1, 2, 4, Kind::Float, Device::Cpu).unwrap();
        let kv = |v: f64, t: i64| Tensor::full([1, 1, t, 2], v, (Kind::Float, Device::Cpu));
        for layer in 0..2 {
            let (k, _) = c.write(layer, &kv(1.0, 3), &kv(2.0, 3)).unwrap();
            assert_eq!(k.size(), [1, 1, 3, 2]);
        }
        c.advance(3);
        c.crop(1);
        let (k, v) = c.write(0, &kv(5.0, 2), &kv(6.0, 2)).unwrap();
        let k: Vec<f32> = Vec::try_from(k.flatten(0, -1)).unwrap();
        let v: Vec<f32> = Vec::try_from(v.flatten(0, -1)).unwrap();
        assert_eq!(k, [1.0, 1.0, 5.0, 5.0, 5.0, 5.0]);
        assert_eq!(v, [2.0, 2.0, 6.0, 6.0, 6.0, 6.0]);
        assert!(c.write(0, &kv(0.0, 4), &kv(0.0, 4)).is_err(), "1 + 4 positions exceed the capacity of 4");

        let (k, _) = c.write_at(1, &Tensor::from_slice(&[3i64, 1]), &kv(7.0, 2), &kv(8.0, 2)).unwrap();
        let k: Vec<f32> = Vec::try_from(k.flatten(0, -1)).unwrap();
        assert_eq!(k, [1.0, 1.0, 7.0, 7.0, 1.0, 1.0, 7.0, 7.0], "rows 1 and 3 written, the whole capacity returned");
    }

    /// Batch rows written at positions of their own: a prefill fills rows from position 0, a step writes each row at
    /// its own position, and nothing else moves.
    #[test]
    fn rows_are_written_at_positions_of_their_own() {
        let mut c = KvCache::new(1, 3, 1, 1, 4, Kind::Float, Device::Cpu).unwrap();
        let prompt = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).view([2, 1, 2, 1]);
        c.fill_rows(0, &Tensor::from_slice(&[2i64, 0]), &prompt, &(&prompt * 10.0)).unwrap();
        let step = Tensor::from_slice(&[5.0f32, 6.0, 7.0]).view([3, 1, 1, 1]);
        let (k, v) = c.write_rows(0, &Tensor::from_slice(&[2i64, 0, 3]), &step, &(&step * 10.0), 4).unwrap();
        let k: Vec<f32> = Vec::try_from(k.flatten(0, -1)).unwrap();
        assert_eq!(k, [3.0, 4.0, 5.0, 0.0, 6.0, 0.0, 0.0, 0.0, 1.0, 2.0, 0.0, 7.0]);
        let v: Vec<f32> = Vec::try_from(v.flatten(0, -1)).unwrap();
        assert_eq!(v[..4], [30.0, 40.0, 50.0, 0.0]);
        // The first rows only: the third is left alone and not returned.
        let (k, _) =
            c.write_rows(0, &Tensor::from_slice(&[1i64, 1]), &step.narrow(0, 0, 2), &step.narrow(0, 0, 2), 2).unwrap();
        assert_eq!(k.size(), [2, 1, 2, 1]);
        let k: Vec<f32> = Vec::try_from(k.flatten(0, -1)).unwrap();
        assert_eq!(k, [3.0, 5.0, 6.0, 6.0]);
        assert!(
            c.fill_rows(
                0,
                &Tensor::from_slice(&[0i64]),
                &Tensor::zeros([1, 1, 5, 1], (Kind::Float, Device::Cpu)),
                &Tensor::zeros([1, 1, 5, 1], (Kind::Float, Device::Cpu))
            )
            .is_err()
        );
    }
}
