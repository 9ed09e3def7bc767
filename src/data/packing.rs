//! Packing conversations into rows of at most `capacity` tokens (`data.pack`): first fit, longest first, which
//! fills rows to within a few percent on real length distributions. The loader packs the whole split once into the
//! units its batches are made of (so every epoch has as many batches); the target packs each batch it is handed
//! again, since which conversations share a row changes nothing that is trained (each attends only to itself).

/// Groups items of the given `lengths` (indices into it) into rows whose lengths sum to at most `capacity`: first
/// fit over the items longest first (ties by index). An item longer than `capacity` gets a row of its own.
/// Deterministic.
pub fn first_fit_decreasing(lengths: &[usize], capacity: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(lengths[i]), i));
    let mut rows: Vec<(usize, Vec<usize>)> = Vec::new();
    for i in order {
        match rows.iter_mut().find(|(used, _)| used + lengths[i] <= capacity) {
            Some((used, items)) => {
                *used += lengths[i];
                items.push(i);
            }
            None => rows.push((lengths[i], vec![i])),
        }
    }
    rows.into_iter().map(|(_, items)| items).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every item once, no row over capacity (unless alone), the longest first in each row; rows nearly full on a
    /// spread of lengths.
    #[test]
    fn rows_hold_every_item_once_within_capacity() {
        let lengths: Vec<usize> = (0..500).map(|i| 20 + (i * 7919) % 900).collect();
        let rows = first_fit_decreasing(&lengths, 2048);
        let mut seen: Vec<usize> = rows.iter().flatten().copied().collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..500).collect::<Vec<_>>());
        for row in &rows {
            assert!(row.iter().map(|&i| lengths[i]).sum::<usize>() <= 2048, "{row:?}");
        }
        let total: usize = lengths.iter().sum();
        let fill = total as f64 / (rows.len() * 2048) as f64;
        assert!(fill > 0.95, "rows {fill:.3} full");
        assert_eq!(first_fit_decreasing(&[5, 3000, 7], 2048), vec![vec![1], vec![2, 0]], "too long: a row alone");
        assert_eq!(first_fit_decreasing(&[], 8), Vec::<Vec<usize>>::new());
    }
}
