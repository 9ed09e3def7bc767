//! `dflash inspect-run`: a run's history of evaluations (`evals.jsonl` beside its checkpoints) as a table, and as a
//! plot of acceptance and held-out loss against steps (SVG: any browser shows it, and it needs no fonts to write).
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, anyhow};
use clap::Args;
use plotters::prelude::*;

use dflash::service::evaluator::{Evaluated, HISTORY_FILE, read_history};

#[derive(Args)]
pub struct InspectRunArgs {
    /// The run's checkpoint.dir, where it keeps evals.jsonl
    #[arg(value_name = "DIR")]
    dir: PathBuf,
    /// Where to write the plot (default: DIR/evals.svg); `-` for none
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// Print the evaluations as JSON lines (one per step) instead of a table
    #[arg(long)]
    json: bool,
}

pub fn run(args: InspectRunArgs) -> Result<ExitCode> {
    let history = read_history(&args.dir)?;
    if history.is_empty() {
        anyhow::bail!("{}: no evaluation recorded yet", args.dir.join(HISTORY_FILE).display());
    }
    if args.json {
        for e in &history {
            println!("{}", serde_json::to_string(e)?);
        }
    } else {
        print!("{}", table(&history));
    }
    let plot = args.plot.unwrap_or_else(|| args.dir.join("evals.svg"));
    if plot != Path::new("-") {
        draw(&history, &plot).with_context(|| format!("writing the plot {}", plot.display()))?;
        eprintln!("plot of acceptance and loss against steps: {}", plot.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// The history as a table, the best decoded acceptance marked.
fn table(history: &[Evaluated]) -> String {
    let best = history.iter().map(|e| e.decode_acceptance_length).fold(f64::MIN, f64::max);
    let mut s = String::from(
        "decoded: tokens per target step, decoding the held-out prompts against greedy decoding; teacher-forced: \
         acceptance on the held-out rows, and their loss\n",
    );
    s.push_str(&format!(
        "{:>8}  {:>8}  {:>14}  {:>13}  {:>11}  {:>8}\n",
        "step", "decoded", "teacher-forced", "held-out loss", "token match", "lossless"
    ));
    let or_dash = |v: Option<f64>, digits: usize| v.map_or_else(|| "-".to_string(), |v| format!("{v:.digits$}"));
    for e in history {
        s.push_str(&format!(
            "{:>8}  {:>8.3}  {:>14}  {:>13}  {:>10.1}%  {:>8}{}\n",
            e.step,
            e.decode_acceptance_length,
            or_dash(e.holdout_acceptance_length, 3),
            or_dash(e.holdout_loss, 4),
            100.0 * e.token_match_rate,
            if e.lossless { "yes" } else { "NO" },
            if e.decode_acceptance_length == best { "  best" } else { "" }
        ));
    }
    s
}

/// The steps a plot spans (at least one).
fn span(history: &[Evaluated]) -> Range<u64> {
    let first = history.first().map_or(0, |e| e.step);
    let last = history.last().map_or(0, |e| e.step);
    first..last.max(first + 1)
}

/// Acceptance (decoded, and teacher-forced where rows were held out) above, held-out loss below.
fn draw(history: &[Evaluated], path: &Path) -> Result<()> {
    let plotted = |e: DrawingAreaErrorKind<std::io::Error>| anyhow!("{e}");
    let root = SVGBackend::new(path, (960, 640)).into_drawing_area();
    root.fill(&WHITE).map_err(plotted)?;
    let (top, bottom) = root.split_vertically(400);
    let decoded: Vec<(u64, f64)> = history.iter().map(|e| (e.step, e.decode_acceptance_length)).collect();
    let forced: Vec<(u64, f64)> = history.iter().filter_map(|e| Some((e.step, e.holdout_acceptance_length?))).collect();
    let high = decoded.iter().chain(&forced).map(|p| p.1).fold(1.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(&top)
        .caption("acceptance length (tokens per target step)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(50)
        .build_cartesian_2d(span(history), 0.0..high)
        .map_err(plotted)?;
    chart.configure_mesh().x_desc("step").draw().map_err(plotted)?;
    for (points, colour, label) in
        [(&decoded, BLUE, "decoded, held-out prompts"), (&forced, RED, "teacher-forced, held-out rows")]
    {
        if points.is_empty() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(points.iter().copied(), colour.stroke_width(2)))
            .map_err(plotted)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2)));
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, colour.filled()))).map_err(plotted)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(plotted)?;
    let losses: Vec<(u64, f64)> = history.iter().filter_map(|e| Some((e.step, e.holdout_loss?))).collect();
    if !losses.is_empty() {
        let (low, high) = losses.iter().fold((f64::MAX, f64::MIN), |(l, h), p| (l.min(p.1), h.max(p.1)));
        let pad = ((high - low) * 0.1).max(1e-3);
        let mut chart = ChartBuilder::on(&bottom)
            .caption("held-out loss", ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(span(history), (low - pad)..(high + pad))
            .map_err(plotted)?;
        chart.configure_mesh().x_desc("step").draw().map_err(plotted)?;
        chart.draw_series(LineSeries::new(losses.iter().copied(), BLACK.stroke_width(2))).map_err(plotted)?;
        chart.draw_series(losses.iter().map(|&p| Circle::new(p, 3, BLACK.filled()))).map_err(plotted)?;
    }
    root.present().map_err(plotted)?;
    Ok(())
}
