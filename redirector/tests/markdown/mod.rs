//! Reading the docs' Markdown: tables, their cells and code spans, headings' anchors.

/// Splits a Markdown table row into its cells (`\|` is a `|` inside a cell).
fn cells(row: &str) -> Vec<String> {
    row.replace(r"\|", "\u{0}")
        .split('|')
        .map(|cell| cell.replace('\u{0}', "|").trim().to_owned())
        .collect()
}

/// The `code` spans of a Markdown text (`\|`, a `|` in a table's cell, unescaped).
pub fn code_spans(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(|span| span.replace(r"\|", "|"))
        .collect()
}

/// The rows of the table headed `header` in `text`, as cells (the first, empty, before the
/// row's opening `|`).
pub fn table(text: &str, header: &str) -> Vec<Vec<String>> {
    let rows: Vec<Vec<String>> = text
        .lines()
        .skip_while(|line| !line.starts_with(header))
        .skip(2)
        .map(str::trim)
        .take_while(|line| line.starts_with('|'))
        .map(cells)
        .collect();
    assert!(!rows.is_empty(), "no table headed {header}");
    rows
}
