//! Presenting replays: a side-by-side text table, JSON lines, and an SVG chart of allocated
//! and reserved bytes over the events.

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;
use serde::Serialize;

use super::{Report, Trace};
use crate::device::size::format_bytes;
use crate::error::{Error, Result};

/// One configuration's replay, or why it could not run.
#[derive(Debug, Clone)]
pub struct Run {
    /// The configuration as given (`default`, `expandable_segments:True`, ...).
    pub config: String,
    pub outcome: std::result::Result<Report, Failure>,
}

/// Why a configuration has no replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The segments reserved when recording started do not fit in the device: an answer, not
    /// a fault.
    DoesNotFit(String),
    /// The settings, or the trace, cannot be replayed.
    Unsupported(String),
}

impl Failure {
    /// The failure of a replay that returned `e`.
    pub fn of(e: &Error) -> Failure {
        match e {
            Error::OutOfMemory(m) => Failure::DoesNotFit(m.clone()),
            e => Failure::Unsupported(e.to_string()),
        }
    }
}

/// A line of `--json` output.
#[derive(Serialize)]
struct JsonRun<'a> {
    config: &'a str,
    #[serde(flatten)]
    report: Option<&'a Report>,
    #[serde(skip_serializing_if = "Option::is_none")]
    does_not_fit: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'a str>,
}

/// One JSON object per run, one per line.
pub fn json_lines(runs: &[Run]) -> String {
    let mut out = String::new();
    for r in runs {
        let (does_not_fit, error) = match &r.outcome {
            Ok(_) => (None, None),
            Err(Failure::DoesNotFit(m)) => (Some(m.as_str()), None),
            Err(Failure::Unsupported(m)) => (None, Some(m.as_str())),
        };
        let line = JsonRun {
            config: &r.config,
            report: r.outcome.as_ref().ok(),
            does_not_fit,
            error,
        };
        out.push_str(&serde_json::to_string(&line).unwrap_or_default());
        out.push('\n');
    }
    out
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// A description of the trace and a table with one row per configuration.
pub fn table(name: &str, trace: &Trace, memory: Option<u64>, runs: &[Run]) -> String {
    let mut out = String::new();
    let allocs = trace.count(super::Action::Alloc);
    let _ = write!(
        out,
        "{name}: device {}, {} events ({allocs} allocations)",
        trace.device,
        trace.events.len()
    );
    if trace.initial.is_empty() {
        out.push_str(", from an empty allocator");
    } else {
        let _ = write!(
            out,
            ", starting with {} segments ({}) reserved",
            trace.initial.len(),
            format_bytes(trace.initial_reserved())
        );
    }
    let _ = writeln!(
        out,
        "\nrecorded peak reserved {} ({} bytes); device memory {}",
        format_bytes(trace.recorded_peak_reserved()),
        trace.recorded_peak_reserved(),
        memory.map_or_else(|| "unlimited".to_string(), format_bytes)
    );
    let width = runs
        .iter()
        .map(|r| r.config.len())
        .max()
        .unwrap_or(0)
        .max(6);
    let _ = writeln!(
        out,
        "{:width$}  {:>14}  {:>14}  {:>9}  {:>12}  {:>5}  {:>9}",
        "config", "peak allocated", "peak reserved", "reserved/", "device", "OOMs", "ns/event"
    );
    let _ = writeln!(
        out,
        "{:width$}  {:>14}  {:>14}  {:>9}  {:>12}  {:>5}  {:>9}",
        "", "", "", "allocated", "allocations", "", ""
    );
    for r in runs {
        match &r.outcome {
            Ok(rep) => {
                let _ = writeln!(
                    out,
                    "{:width$}  {:>14}  {:>14}  {:>9.3}  {:>12}  {:>5}  {:>9.0}",
                    r.config,
                    gib(rep.peak_allocated_bytes),
                    gib(rep.peak_reserved_bytes),
                    rep.ratio(),
                    rep.num_device_alloc,
                    rep.ooms,
                    rep.ns_per_event
                );
            }
            Err(Failure::DoesNotFit(m)) => {
                let _ = writeln!(out, "{:width$}  does not fit: {m}", r.config);
            }
            Err(Failure::Unsupported(m)) => {
                let _ = writeln!(out, "{:width$}  unsupported: {m}", r.config);
            }
        }
    }
    for r in runs {
        if let Ok(Report {
            first_oom_event: Some(o),
            ..
        }) = &r.outcome
        {
            let _ = writeln!(
                out,
                "{}: first out of memory at event {} (alloc of {} on stream {:#x}) with {} allocated and {} reserved",
                r.config,
                o.index,
                format_bytes(o.size),
                o.stream,
                format_bytes(o.allocated_bytes),
                format_bytes(o.reserved_bytes)
            );
        }
    }
    out
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(140, 86, 75),
];

/// Draws allocated bytes (the program's, the same under every configuration without OOMs)
/// and each configuration's reserved bytes over the events, as SVG into `path`. Runs need a
/// time series ([`super::Options::series`]).
pub fn svg(path: &Path, title: &str, runs: &[Run]) -> Result<()> {
    let ok: Vec<(&str, &Report)> = runs
        .iter()
        .filter_map(|r| r.outcome.as_ref().ok().map(|rep| (r.config.as_str(), rep)))
        .collect();
    let draw_err =
        |e: String| Error::InvalidArgument(format!("cannot draw {}: {e}", path.display()));
    let events = ok
        .iter()
        .map(|(_, r)| r.series.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let top = ok
        .iter()
        .flat_map(|(_, r)| {
            r.series
                .iter()
                .map(|s| s.reserved_bytes.max(s.allocated_bytes))
        })
        .max()
        .unwrap_or(0) as f64
        / (1u64 << 30) as f64;
    let root = SVGBackend::new(path, (1000, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| draw_err(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0usize..events, 0f64..(top * 1.05).max(1e-3))
        .map_err(|e| draw_err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("event")
        .y_desc("GiB")
        .draw()
        .map_err(|e| draw_err(e.to_string()))?;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    // Thousands of points per line are enough for a chart of a thousand pixels.
    let stride = (events / 4000).max(1);
    if let Some((_, first)) = ok.first() {
        chart
            .draw_series(LineSeries::new(
                first
                    .series
                    .iter()
                    .step_by(stride)
                    .map(|s| (s.index, gib(s.allocated_bytes))),
                BLACK.stroke_width(1),
            ))
            .map_err(|e| draw_err(e.to_string()))?
            .label("allocated")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    }
    for (i, (config, rep)) in ok.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(
                rep.series
                    .iter()
                    .step_by(stride)
                    .map(|s| (s.index, gib(s.reserved_bytes))),
                color.stroke_width(2),
            ))
            .map_err(|e| draw_err(e.to_string()))?
            .label(format!("reserved ({config})"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| draw_err(e.to_string()))?;
    root.present().map_err(|e| draw_err(e.to_string()))?;
    Ok(())
}
