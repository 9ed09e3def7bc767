//! Reading and writing safetensors weights the way HuggingFace lays them out: one `model.safetensors`, or shards
//! named by `model.safetensors.index.json`. Files are memory-mapped and checked (header, sizes) when opened, so a
//! truncated download is reported before any tensor is built; every tensor is checked against the shape the
//! architecture implies.
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors, View};
use serde_json::json;
use tch::{Device, Kind, Tensor};

use super::ModelError;

const SINGLE: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

struct MappedFile {
    path: PathBuf,
    map: Mmap,
    header_len: usize,
    metadata: Metadata,
}

/// The weights of one model folder, memory-mapped; tensors are copied out on request.
pub struct WeightFiles {
    dir: PathBuf,
    files: Vec<MappedFile>,
    /// tensor name -> index into `files`
    location: HashMap<String, usize>,
    source: &'static str,
}

impl WeightFiles {
    /// Opens `dir/model.safetensors.index.json` and its shards, or else `dir/model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let index_path = dir.join(INDEX);
        if index_path.exists() {
            return Self::open_sharded(dir, &index_path);
        }
        let single = dir.join(SINGLE);
        if !single.exists() {
            return Err(ModelError::NoWeights { dir: dir.to_path_buf() });
        }
        Ok(WeightFiles { source: SINGLE, ..Self::open_file(&single)? })
    }

    /// Opens one safetensors file by path (an optimizer state, say).
    pub fn open_file(path: &Path) -> Result<Self, ModelError> {
        let file = map_file(path)?;
        let location = file.metadata.tensors().into_keys().map(|name| (name, 0)).collect();
        Ok(WeightFiles {
            dir: path.parent().unwrap_or(Path::new(".")).to_path_buf(),
            files: vec![file],
            location,
            source: "the file",
        })
    }

    fn open_sharded(dir: &Path, index_path: &Path) -> Result<Self, ModelError> {
        let bad_index = |reason: String| ModelError::Index { path: index_path.to_path_buf(), reason };
        let text = std::fs::read_to_string(index_path)
            .map_err(|err| ModelError::Io { path: index_path.to_path_buf(), err })?;
        let index: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad_index(format!("not valid JSON: {e}")))?;
        let map = index
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad_index("no `weight_map` object".into()))?;
        let mut shard_ids: BTreeMap<String, usize> = BTreeMap::new();
        let mut files = Vec::new();
        let mut location = HashMap::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| bad_index(format!("`weight_map.{name}` is not a file name")))?;
            let id = match shard_ids.get(file) {
                Some(id) => *id,
                None => {
                    files.push(map_file(&dir.join(file))?);
                    shard_ids.insert(file.to_string(), files.len() - 1);
                    files.len() - 1
                }
            };
            if files[id].metadata.info(name).is_none() {
                return Err(bad_index(format!(
                    "maps `{name}` to {file}, which does not contain it; the folder is inconsistent: re-download it"
                )));
            }
            location.insert(name.clone(), id);
        }
        Ok(WeightFiles { dir: dir.to_path_buf(), files, location, source: INDEX })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.location.contains_key(name)
    }

    /// The shape of tensor `name`, read from its file's header; `None` when no file holds it.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let file = &self.files[*self.location.get(name)?];
        file.metadata.info(name).map(|info| info.shape.clone())
    }

    /// Copies tensor `name` to `device` as `kind`, after checking its shape is `expected`. `why` says where the
    /// expectation comes from (for example "config.json: hidden_size=4096") so a mismatch names it.
    pub fn load(
        &self,
        name: &str,
        expected: &[usize],
        why: &str,
        kind: Kind,
        device: Device,
    ) -> Result<Tensor, ModelError> {
        let file = self.location.get(name).map(|&i| &self.files[i]).ok_or_else(|| ModelError::MissingTensor {
            name: name.to_string(),
            dir: self.dir.clone(),
            source_file: self.source,
        })?;
        let info: &TensorInfo = file.metadata.info(name).expect("location only lists tensors present in their file");
        if info.shape != expected {
            return Err(ModelError::Shape {
                name: name.to_string(),
                path: file.path.clone(),
                found: info.shape.clone(),
                expected: expected.to_vec(),
                why: why.to_string(),
            });
        }
        let file_kind = kind_of(info.dtype).ok_or_else(|| ModelError::Dtype {
            name: name.to_string(),
            path: file.path.clone(),
            dtype: format!("{:?}", info.dtype),
        })?;
        let start = 8 + file.header_len + info.data_offsets.0;
        let end = 8 + file.header_len + info.data_offsets.1;
        let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
        let host = Tensor::f_from_data_size(&file.map[start..end], &shape, file_kind)?;
        // Move first, then cast on the device: half the bytes cross the bus when the file holds bf16.
        Ok(host.f_to_device(device)?.f_to_kind(kind)?)
    }
}

fn map_file(path: &Path) -> Result<MappedFile, ModelError> {
    let file = File::open(path).map_err(|err| ModelError::Io { path: path.to_path_buf(), err })?;
    // SAFETY: the file is opened read-only and model folders are not modified while a model loads.
    let map = unsafe { Mmap::map(&file) }.map_err(|err| ModelError::Io { path: path.to_path_buf(), err })?;
    let (header_len, metadata) = SafeTensors::read_metadata(&map)
        .map_err(|e| ModelError::Safetensors { path: path.to_path_buf(), reason: e.to_string() })?;
    Ok(MappedFile { path: path.to_path_buf(), map, header_len, metadata })
}

pub(super) fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F16 => Kind::Half,
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        Dtype::I64 => Kind::Int64,
        Dtype::U8 => Kind::Uint8,
        _ => return None,
    })
}

/// The 16 values of an FP4 (e2m1) code: `+0, 0.5, 1, 1.5, 2, 3, 4, 6`, then the same negated.
const FP4_VALUES: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// MXFP4 (OCP microscaling, as GPT-OSS's experts are published) to `kind`: `blocks [.., G, 16]` u8 hold 32 FP4 codes
/// per group, the low nibble first; `scales [.., G]` u8 are each group's power of two, biased by 127. Returns
/// `[.., G * 32]`. Exact: every value is a small binary fraction times a power of two.
pub fn dequantize_mxfp4(blocks: &Tensor, scales: &Tensor, kind: Kind) -> Result<Tensor, tch::TchError> {
    let size = blocks.size();
    let lut = Tensor::f_from_slice(&FP4_VALUES)?.f_to(blocks.device())?;
    let codes = blocks.f_to_kind(Kind::Int64)?;
    let low = lut.f_index_select(0, &codes.f_bitwise_and(15)?.f_view([-1])?)?;
    let high = lut.f_index_select(0, &codes.f_bitwise_right_shift_tensor_scalar(4)?.f_view([-1])?)?;
    let mut shape = size[..size.len() - 1].to_vec();
    let values =
        Tensor::f_stack(&[low, high], 1)?.f_view(&shape.iter().copied().chain([32]).collect::<Vec<_>>()[..])?;
    let exponent = scales.f_to_kind(Kind::Float)?.f_sub_scalar(127.0)?.f_exp2()?.f_unsqueeze(-1)?;
    let last = shape.pop().expect("blocks have a group dimension");
    shape.push(last * 32);
    values.f_mul(&exponent)?.f_view(&shape[..])?.f_to_kind(kind)
}

fn dtype_of(kind: Kind) -> Result<Dtype, ModelError> {
    Ok(match kind {
        Kind::BFloat16 => Dtype::BF16,
        Kind::Half => Dtype::F16,
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        Kind::Int64 => Dtype::I64,
        Kind::Uint8 => Dtype::U8,
        other => {
            return Err(ModelError::Torch(format!("cannot write tensors of kind {other:?}")));
        }
    })
}

/// A tensor copied to host memory, ready to be written.
pub struct HostTensor {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl HostTensor {
    pub fn from_tensor(t: &Tensor) -> Result<Self, ModelError> {
        let t = t.f_to_device(Device::Cpu)?.f_contiguous()?;
        let dtype = dtype_of(t.kind())?;
        let numel = t.numel();
        let mut bytes = vec![0u8; numel * dtype.bitsize() / 8];
        t.f_copy_data_u8(&mut bytes, numel)?;
        Ok(HostTensor { dtype, shape: t.size().iter().map(|&d| d as usize).collect(), bytes })
    }
}

impl View for &HostTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Writes `tensors` to one safetensors file (flushed and synced before it returns).
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, HostTensor)],
    metadata: Option<HashMap<String, String>>,
) -> Result<(), ModelError> {
    let io = |err| ModelError::Io { path: path.to_path_buf(), err };
    let bytes = safetensors::serialize(tensors.iter().map(|(n, t)| (n.as_str(), t)), metadata)
        .map_err(|e| ModelError::Safetensors { path: path.to_path_buf(), reason: e.to_string() })?;
    let mut file = File::create(path).map_err(io)?;
    file.write_all(&bytes).map_err(io)?;
    file.sync_all().map_err(io)
}

/// Writes `tensors` as HuggingFace does: one `model.safetensors` if they fit in `max_shard_bytes`, else shards
/// `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`.
pub fn write_sharded(dir: &Path, tensors: Vec<(String, HostTensor)>, max_shard_bytes: usize) -> Result<(), ModelError> {
    let total: usize = tensors.iter().map(|(_, t)| t.bytes.len()).sum();
    let mut shards: Vec<Vec<(String, HostTensor)>> = vec![vec![]];
    let mut current = 0usize;
    for (name, t) in tensors {
        let len = t.bytes.len();
        if current > 0 && current + len > max_shard_bytes {
            shards.push(vec![]);
            current = 0;
        }
        shards.last_mut().expect("at least one shard").push((name, t));
        current += len;
    }
    if shards.len() == 1 {
        return write_safetensors(&dir.join(SINGLE), &shards[0], None);
    }
    let n = shards.len();
    let mut weight_map = BTreeMap::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
        write_safetensors(&dir.join(&file), shard, None)?;
        for (name, _) in shard {
            weight_map.insert(name.clone(), file.clone());
        }
    }
    let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    let path = dir.join(INDEX);
    std::fs::write(&path, serde_json::to_string_pretty(&index).expect("json"))
        .map_err(|err| ModelError::Io { path, err })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The codes and scales of the OCP MX spec by hand: nibbles low first, the E8M0 scale 2^(s - 127).
    #[test]
    fn mxfp4_decodes_nibbles_low_first_times_the_group_scale() {
        let mut bytes = vec![0u8; 32];
        bytes[0] = 0x21; // low 1 -> 0.5, high 2 -> 1.0
        bytes[1] = 0xF8; // low 8 -> -0.0, high 15 -> -6.0
        bytes[16] = 0x7A; // second group: low 10 -> -1.0, high 7 -> 6.0
        let blocks = Tensor::from_slice(&bytes).view([2, 16]);
        let scales = Tensor::from_slice(&[128u8, 125]);
        let out: Vec<f32> = Vec::try_from(&dequantize_mxfp4(&blocks, &scales, Kind::Float).unwrap()).unwrap();
        assert_eq!(out.len(), 64);
        assert_eq!(&out[..4], &[1.0, 2.0, -0.0, -12.0]);
        assert!(out[4..32].iter().all(|&v| v == 0.0));
        assert_eq!(&out[32..34], &[-0.25, 1.5]);
        // Leading dimensions are kept: [2, 3, G=2, 16] -> [2, 3, 64].
        let many = dequantize_mxfp4(
            &Tensor::zeros([2, 3, 2, 16], (Kind::Uint8, Device::Cpu)),
            &Tensor::full([2, 3, 2], 127, (Kind::Uint8, Device::Cpu)),
            Kind::BFloat16,
        )
        .unwrap();
        assert_eq!(many.size(), vec![2, 3, 64]);
    }
}
