//! The kernels' argument blocks as Rust sees them. Their one definition is C (`csrc/kernel_args.h`): the C++ side
//! includes it, the kernels' source is compiled with it in front ([`SOURCE`]), and these `#[repr(C)]` copies are
//! checked against its text field by field (name, offset, C type) by the test below, which CI runs: a field moved or
//! two swapped on either side fail it, where a size check passes them.
use std::ffi::c_void;

/// The kernels' source as NVRTC compiles it: the header, then `staircase.cu`.
pub(super) const SOURCE: &str = concat!(include_str!("../../../csrc/kernel_args.h"), include_str!("../staircase.cu"));

/// The training kernels' block, filled by `csrc/staircase.cpp`; [`super::launch`] reads the shapes it launches by.
#[repr(C)]
pub(super) struct StaircaseArgs {
    q: *const c_void,
    q_b: i64,
    q_h: i64,
    q_t: i64,
    k_ctx: *const c_void,
    v_ctx: *const c_void,
    c_b: i64,
    c_h: i64,
    c_t: i64,
    cv_b: i64,
    cv_h: i64,
    cv_t: i64,
    k_blk: *const c_void,
    v_blk: *const c_void,
    k_b: i64,
    k_h: i64,
    k_t: i64,
    bv_b: i64,
    bv_h: i64,
    bv_t: i64,
    lo: *const c_void,
    hi: *const c_void,
    pub(super) heads: i32,
    pub(super) kv_heads: i32,
    /// Units of 16 query rows a row, a warp each.
    pub(super) units: i32,
    pub(super) context: i32,
    causal_block: i32,
    window: i32,
    /// Blocks a unit: 1, or 2 for blocks of 8.
    pub(super) per: i32,
    scale: f32,
}

/// Batch-1 decoding's block, filled by [`super::decode_attention`].
#[repr(C)]
pub(super) struct DecodeArgs {
    pub(super) q: *const c_void,
    pub(super) q_h: i64,
    pub(super) q_t: i64,
    pub(super) k: *const c_void,
    pub(super) v: *const c_void,
    pub(super) k_h: i64,
    pub(super) k_t: i64,
    pub(super) v_h: i64,
    pub(super) v_t: i64,
    pub(super) start: *const c_void,
    pub(super) part: *mut c_void,
    pub(super) part_lse: *mut c_void,
    pub(super) o: *mut c_void,
    pub(super) heads: i32,
    pub(super) kv_heads: i32,
    pub(super) t: i32,
    pub(super) chunk: i32,
    pub(super) splits: i32,
    pub(super) causal: i32,
    pub(super) window: i32,
    pub(super) scale: f32,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header the kernels' source is compiled with.
    const HEADER: &str = include_str!("../../../csrc/kernel_args.h");

    /// A field as C lays it out: its name, offset and type class (`pointer`, `long long`, `int`, `float`).
    type Field = (String, usize, &'static str);

    /// The fields of `struct NAME` in `header`, laid out by the C rules of x86-64 and aarch64 Linux (each field at the
    /// next multiple of its own size, every type here its own alignment), and the struct's size.
    fn c_layout(header: &str, name: &str) -> (Vec<Field>, usize) {
        let open = format!("struct {name} {{");
        let start = header.find(&open).unwrap_or_else(|| panic!("no `{open}` in csrc/kernel_args.h")) + open.len();
        let body = &header[start..start + header[start..].find("};").expect("the struct ends")];
        let code: String = body.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join(" ");
        let (mut fields, mut offset, mut align) = (Vec::new(), 0usize, 1usize);
        for declaration in code.split(';').map(str::trim).filter(|d| !d.is_empty()) {
            // `TYPE a, *b, c`: the type up to the first declarator; a `*` makes that declarator a pointer.
            let mut words = declaration.split(',');
            let first = words.next().unwrap_or("").trim();
            let cut = first.rfind([' ', '*']).expect("a type and a name") + 1;
            let base = first[..cut].trim_end_matches(['*', ' ']).trim_start_matches("const ").trim();
            let pointer = first[..cut].contains('*');
            let mut declarators = vec![(first[cut..].to_string(), pointer)];
            declarators.extend(words.map(|w| (w.trim().trim_start_matches('*').to_string(), w.contains('*'))));
            for (field, pointer) in declarators {
                let (class, size) = match (pointer, base) {
                    (true, _) => ("pointer", 8),
                    (false, "long long") => ("long long", 8),
                    (false, "int") => ("int", 4),
                    (false, "float") => ("float", 4),
                    (false, other) => {
                        panic!("field `{field}` of {name} has type `{other}`, which this check cannot lay out")
                    }
                };
                offset = offset.next_multiple_of(size);
                fields.push((field, offset, class));
                offset += size;
                align = align.max(size);
            }
        }
        (fields, offset.next_multiple_of(align))
    }

    /// The C type class of a Rust field's type.
    trait CClass {
        const CLASS: &'static str;
    }
    impl CClass for *const c_void {
        const CLASS: &'static str = "pointer";
    }
    impl CClass for *mut c_void {
        const CLASS: &'static str = "pointer";
    }
    impl CClass for i64 {
        const CLASS: &'static str = "long long";
    }
    impl CClass for i32 {
        const CLASS: &'static str = "int";
    }
    impl CClass for f32 {
        const CLASS: &'static str = "float";
    }
    fn class_of<S, T: CClass>(_field: fn(&S) -> &T) -> &'static str {
        T::CLASS
    }

    /// Each named field of a Rust struct with its offset and C type class.
    macro_rules! rust_layout {
        ($ty:ident { $($field:ident),* $(,)? }) => {
            (vec![$((
                stringify!($field).to_string(),
                std::mem::offset_of!($ty, $field),
                class_of(|s: &$ty| &s.$field),
            )),*], std::mem::size_of::<$ty>())
        };
    }

    #[test]
    fn the_rust_argument_blocks_match_the_c_header_field_by_field() {
        let staircase = rust_layout!(StaircaseArgs {
            q,
            q_b,
            q_h,
            q_t,
            k_ctx,
            v_ctx,
            c_b,
            c_h,
            c_t,
            cv_b,
            cv_h,
            cv_t,
            k_blk,
            v_blk,
            k_b,
            k_h,
            k_t,
            bv_b,
            bv_h,
            bv_t,
            lo,
            hi,
            heads,
            kv_heads,
            units,
            context,
            causal_block,
            window,
            per,
            scale,
        });
        let decode = rust_layout!(DecodeArgs {
            q,
            q_h,
            q_t,
            k,
            v,
            k_h,
            k_t,
            v_h,
            v_t,
            start,
            part,
            part_lse,
            o,
            heads,
            kv_heads,
            t,
            chunk,
            splits,
            causal,
            window,
            scale,
        });
        for (name, (mut rust, size)) in [("StaircaseArgs", staircase), ("DecodeArgs", decode)] {
            let (c, c_size) = c_layout(HEADER, name);
            rust.sort_by_key(|f| f.1);
            assert_eq!(rust, c, "{name}: the Rust fields (name, offset, C type) against csrc/kernel_args.h");
            assert_eq!(size, c_size, "{name}: the size");
        }
        assert_eq!(std::mem::size_of::<StaircaseArgs>(), 208, "the layout the kernels were measured with");
    }

    /// The check sees what it is for: two fields of one type swapped in the C text, or a type changed, fail it.
    #[test]
    fn the_layout_check_sees_swapped_fields_and_changed_types() {
        let (c, _) = c_layout(HEADER, "DecodeArgs");
        let swapped = HEADER.replacen("long long k_h, k_t, v_h, v_t;", "long long k_h, k_t, v_t, v_h;", 1);
        assert_ne!(c_layout(&swapped, "DecodeArgs").0, c, "swapped strides");
        let retyped = HEADER.replacen("int heads, kv_heads, t, chunk", "float heads; int kv_heads, t, chunk", 1);
        assert_ne!(c_layout(&retyped, "DecodeArgs").0, c, "a type changed");
        let names: Vec<&str> = c.iter().map(|f| f.0.as_str()).collect();
        assert_eq!(&names[..5], ["q", "q_h", "q_t", "k", "v"], "pointer declarators (`*k, *v`) parsed");
        assert!(SOURCE.starts_with(HEADER) && SOURCE.contains("decode_attention(DecodeArgs a)"));
    }
}
